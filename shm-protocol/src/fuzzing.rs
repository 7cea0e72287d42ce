//! Entry point shared by the cargo-fuzz target and the property tests: lay
//! arbitrary bytes into a real ring segment as a hostile producer would, and
//! run the consumer's record parser and decoder over them. Must never panic,
//! hang, or touch memory outside the segment. Also the hostile peer's own
//! tools, for tests that attack a daemon through a mapped ring: scribble
//! bytes into a segment's data area, move its tail or head anywhere.

use std::sync::atomic::Ordering;

use crate::layout::{MIN_CAPACITY, RECORD_HEADER_SIZE};
use crate::ring::Consumer;
use crate::segment::Segment;

/// Writes `bytes` into `seg`'s data area from byte `offset` (wrapping at
/// the end), as a producer that ignores the record format would. The
/// segment is shared: only atomic-free copies into its data area, no
/// reference to it is held.
pub fn scribble(seg: &Segment, offset: u64, bytes: &[u8]) {
    let capacity = seg.capacity();
    for (i, b) in bytes.iter().enumerate() {
        let at = (offset + i as u64) % capacity;
        // SAFETY: `at` is below the data area's capacity, so the write is
        // inside the mapping; it is a single byte, and the peer reading
        // shared memory must treat it as hostile anyway.
        unsafe { seg.data_ptr().add(at as usize).write_volatile(*b) };
    }
}

/// Publishes `tail` as `seg`'s producer position, whatever it is.
pub fn set_tail(seg: &Segment, tail: u64) {
    seg.header().tail.0.store(tail, Ordering::Release);
}

/// Publishes `head` as `seg`'s consumer position, whatever it is.
pub fn set_head(seg: &Segment, head: u64) {
    seg.header().head.0.store(head, Ordering::Release);
}

/// What the consumer made of the bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub records: u64,
    pub decoded: u64,
    pub poisoned: bool,
}

/// `input[..8]` is the claimed tail (little-endian); the rest fills the data
/// area of a 4 KiB ring from offset 0. Polls until the ring is empty or
/// poisoned, which must happen within `capacity / 16 + 1` polls.
pub fn consume_hostile_bytes(input: &[u8]) -> Outcome {
    let mut consumer = Consumer::create(MIN_CAPACITY, 0).expect("create ring segment");
    let (tail, data) = input.split_at(input.len().min(8));
    let mut tail_bytes = [0u8; 8];
    tail_bytes[..tail.len()].copy_from_slice(tail);
    let data = &data[..data.len().min(MIN_CAPACITY as usize)];
    let base = consumer.segment().data_ptr();
    // SAFETY: `data` is at most the ring's capacity, so the copy stays
    // inside the data area; no reference to the shared bytes is held.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base, data.len()) };
    consumer
        .segment()
        .header()
        .tail
        .0
        .store(u64::from_le_bytes(tail_bytes), Ordering::Release);
    let mut out = Outcome::default();
    let bound = MIN_CAPACITY / RECORD_HEADER_SIZE as u64 + 1;
    for _ in 0..=bound {
        match consumer.poll() {
            Ok(Some(r)) => {
                out.records += 1;
                if kvedge_schema::messages::decode(r.kind, r.payload).is_ok() {
                    out.decoded += 1;
                }
            }
            Ok(None) => return out,
            Err(_) => {
                out.poisoned = true;
                return out;
            }
        }
    }
    panic!("consumer made no progress within {bound} polls");
}
