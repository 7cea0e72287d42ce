//! The entry point shared by the cargo-fuzz target `msgpack_batch` and the
//! property tests below: any bytes as a KV-event payload from an engine.
//! The decoder must return a batch or an error, never panic or allocate
//! per event, and the translator must index no more blocks than its
//! capacity, whatever the bytes claim.

use kvedge_schema::messages::{StoredBlock, Tier};

use crate::decode::Decoder;
use crate::translate::{Sink, Translator};

/// Blocks a fuzzed translator may remember.
pub const CAPACITY: usize = 64;

/// What the decoder made of the bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    /// Whether the bytes were a batch (else an error).
    pub batch: bool,
    pub stored: usize,
    pub removed: usize,
}

struct Count<'a>(&'a mut Decoded);

impl Sink for Count<'_> {
    fn stored(&mut self, _: Tier, blocks: &[StoredBlock], _: u64) {
        self.0.stored += blocks.len();
    }
    fn removed(&mut self, _: Tier, hashes: &[u64]) {
        self.0.removed += hashes.len();
    }
    fn cleared(&mut self) {}
}

/// Decodes `payload` as a batch (block size 4) into a fresh translator.
pub fn decode_hostile_batch(payload: &[u8]) -> Decoded {
    let mut d = Decoded::default();
    let mut t = Translator::new(4, CAPACITY);
    let mut sink = Count(&mut d);
    let result = Decoder::new().decode(payload, |e| t.apply(e, &mut sink));
    d.batch = result.is_ok();
    assert!(t.len() <= CAPACITY, "the translator's capacity holds");
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::{EventOut, Layout, write_batch};
    use proptest::prelude::*;

    fn valid(hashes: &[u64], tokens: &[u32]) -> Vec<u8> {
        let mut b = Vec::new();
        let events = [
            EventOut::Stored {
                hashes,
                parent: None,
                tokens,
                block_size: 4,
                medium: "GPU",
            },
            EventOut::Removed {
                hashes: &hashes[..1],
                medium: "GPU",
            },
        ];
        write_batch(&mut b, 1.5, &events, Layout::Map, Some(0));
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_payloads_never_panic(data in proptest::collection::vec(any::<u8>(), 0..1024)) {
            let _ = decode_hostile_batch(&data);
        }

        #[test]
        fn damaged_batches_never_panic(
            n in 1usize..8,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
            cut in any::<usize>(),
        ) {
            let hashes: Vec<u64> = (1..=n as u64).collect();
            let tokens: Vec<u32> = (0..4 * n as u32).collect();
            let mut data = valid(&hashes, &tokens);
            for (at, x) in flips {
                let i = at % data.len();
                data[i] ^= x;
            }
            data.truncate(1 + cut % data.len());
            let _ = decode_hostile_batch(&data);
        }
    }

    #[test]
    fn the_entry_point_decodes_a_valid_batch() {
        let d = decode_hostile_batch(&valid(&[1, 2], &[0, 1, 2, 3, 4, 5, 6, 7]));
        assert_eq!(
            d,
            Decoded {
                batch: true,
                stored: 2,
                removed: 1
            }
        );
        assert!(!decode_hostile_batch(b"\xc1").batch);
    }
}
