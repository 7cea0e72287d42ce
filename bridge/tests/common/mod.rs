//! A sink that records what the bridge would put in a worker's ring.

#![allow(dead_code)]

use kvedge_bridge::translate::Sink;
use kvedge_shm::messages::{StoredBlock, Tier};

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
