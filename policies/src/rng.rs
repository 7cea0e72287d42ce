//! The per-instance random source. Every random choice a built-in makes
//! comes from here, seeded from the router seed, the instance and the
//! partition, so a recorded run replays to the same decisions.

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::context::RoutingPartition;

/// A seeded, portable generator (xoshiro256++).
#[derive(Clone, Debug)]
pub struct PolicyRng(Xoshiro256PlusPlus);

impl PolicyRng {
    pub fn seed_from_u64(seed: u64) -> Self {
        PolicyRng(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    /// The seed an instance uses in a partition: the base seed mixed with
    /// role and model, so partitions draw independent streams.
    pub fn for_partition(seed: u64, partition: &RoutingPartition) -> Self {
        let mut bytes = Vec::with_capacity(16 + partition.model.len());
        bytes.extend_from_slice(&seed.to_le_bytes());
        bytes.extend_from_slice(partition.worker_type.as_str().as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(partition.model.as_bytes());
        Self::seed_from_u64(xxhash_rust::xxh3::xxh3_64(&bytes))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n); `n` must be positive.
    pub fn below(&mut self, n: usize) -> usize {
        // Lemire's multiply-shift; the bias for n far below 2^64 is negligible.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::WorkerType;

    #[test]
    fn same_seed_same_stream_and_partitions_differ() {
        let p = RoutingPartition::new(WorkerType::Prefill, "llama");
        let q = RoutingPartition::new(WorkerType::Decode, "llama");
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = PolicyRng::for_partition(7, &p);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = PolicyRng::for_partition(7, &p);
                move |_| r.next_u64()
            })
            .collect();
        let c: Vec<u64> = (0..4)
            .map({
                let mut r = PolicyRng::for_partition(7, &q);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mut r = PolicyRng::seed_from_u64(1);
        for _ in 0..1000 {
            assert!(r.below(3) < 3);
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
