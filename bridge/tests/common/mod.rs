//! A sink that records what the bridge would put in a worker's ring.

#![allow(dead_code)]

use kvedge_bridge::encode::{EventOut, Layout, write_batch};
use kvedge_bridge::translate::Sink;
use kvedge_schema::messages::{StoredBlock, Tier};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    Stored(Tier, Vec<u64>, u64),
    Removed(Tier, Vec<u64>),
    Cleared,
}

#[derive(Debug, Default)]
pub struct Recorder(pub Vec<Out>);

impl Sink for Recorder {
    fn stored(&mut self, tier: Tier, blocks: &[StoredBlock], seed: u64) {
        self.0.push(Out::Stored(
            tier,
            blocks.iter().map(|b| b.sequence_hash).collect(),
            seed,
        ));
    }
    fn removed(&mut self, tier: Tier, hashes: &[u64]) {
        self.0.push(Out::Removed(tier, hashes.to_vec()));
    }
    fn cleared(&mut self) {
        self.0.push(Out::Cleared);
    }
}

pub fn golden(name: &str) -> Vec<u8> {
    let path = format!("{}/../testdata/engines/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A batch in vLLM's positional layout.
pub fn batch(events: &[EventOut<'_>]) -> Vec<u8> {
    let mut b = Vec::new();
    write_batch(&mut b, 1.5, events, Layout::Array, None);
    b
}

/// A batch around events encoded by hand (hostile ones).
pub fn raw_batch(events: &[Vec<u8>]) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 2).unwrap();
    rmp::encode::write_f64(&mut b, 1.5).unwrap();
    rmp::encode::write_array_len(&mut b, events.len() as u32).unwrap();
    for e in events {
        b.extend_from_slice(e);
    }
    b
}

/// Blocks stored on the GPU.
pub fn stored<'a>(
    hashes: &'a [u64],
    parent: Option<u64>,
    tokens: &'a [u32],
    block_size: u32,
) -> EventOut<'a> {
    EventOut::Stored {
        hashes,
        parent,
        tokens,
        block_size,
        medium: "GPU",
    }
}

/// Blocks removed from the GPU.
pub fn removed(hashes: &[u64]) -> EventOut<'_> {
    EventOut::Removed {
        hashes,
        medium: "GPU",
    }
}

/// A sink that only counts (allocation-free).
#[derive(Debug, Default)]
pub struct Counter {
    pub stored: usize,
    pub removed: usize,
}

impl Sink for Counter {
    fn stored(&mut self, _: Tier, blocks: &[StoredBlock], _: u64) {
        self.stored += blocks.len();
    }
    fn removed(&mut self, _: Tier, hashes: &[u64]) {
        self.removed += hashes.len();
    }
    fn cleared(&mut self) {}
}
