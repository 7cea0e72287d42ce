//! Entry point shared by the cargo-fuzz target and the property tests: lay
//! arbitrary bytes into a real ring segment as a hostile producer would, and
//! run the consumer's record parser and decoder over them. Must never panic,
//! hang, or touch memory outside the segment.

use std::sync::atomic::Ordering;

use crate::layout::{MIN_CAPACITY, RECORD_HEADER_SIZE};
use crate::ring::Consumer;

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
                if crate::messages::decode(r.kind, r.payload).is_ok() {
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
