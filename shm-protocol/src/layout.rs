//! The byte layout of a ring segment, shared by both ends: the header page
//! (identity line plus one 128-byte line per independently written counter),
//! the record header, and the layout fingerprint that makes a producer built
//! against a different layout or rkyv format refuse to attach.

use std::mem::{align_of, offset_of, size_of};
use std::sync::atomic::{AtomicU32, AtomicU64};

/// `b"KVEDGRNG"` as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVEDGRNG");
/// Major version: a change here is incompatible.
pub const VERSION_MAJOR: u16 = 1;
/// Minor version: additions a v1 consumer may ignore (new record types).
pub const VERSION_MINOR: u16 = 1;
/// The data area starts on its own page after the header.
pub const HEADER_SIZE: usize = 4096;
/// Records (and so record payloads) start on 16-byte boundaries.
pub const RECORD_ALIGN: usize = 16;
/// Bytes of the record header: `len: u32 | type: u16 | flags: u16 | seq: u64`.
pub const RECORD_HEADER_SIZE: usize = 16;
/// Smallest ring the daemon will create.
pub const MIN_CAPACITY: u64 = 4096;
/// Largest ring: 1 GiB.
pub const MAX_CAPACITY: u64 = 1 << 30;
/// Record type of the padding record written at the wrap point.
pub const PADDING_TYPE: u16 = u16::MAX;

/// One cache-line pair of its own (128 bytes covers adjacent-line prefetch).
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct Line<T>(pub T);

/// The identity fields, written by the consumer at creation.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Identity {
    pub magic: AtomicU64,
    pub version_major: AtomicU32,
    pub version_minor: AtomicU32,
    pub layout_hash: AtomicU64,
    pub capacity: AtomicU64,
    /// Written by the producer when it attaches (informational: the daemon
    /// trusts SO_PEERCRED, not this field).
    pub producer_pid: AtomicU32,
    /// Written by the producer when it attaches: [`PRODUCER_ASYMMETRIC_FENCE`]
    /// when its process registered for expedited global membarriers.
    pub producer_flags: AtomicU32,
    /// Bumped by the daemon for every registration of a worker identity.
    pub attach_epoch: AtomicU64,
}

/// The header page. Every field is atomic: the other side may write any of
/// them at any time, and no bit pattern is invalid.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Header {
    pub identity: Line<Identity>,
    /// Producer-owned: byte position one past the last committed record.
    pub tail: Line<AtomicU64>,
    /// Consumer-owned: byte position of the next record to read.
    pub head: Line<AtomicU64>,
    /// Consumer-owned: [`CONSUMER_SLEEPING`] while the consumer is (about to
    /// be) asleep, [`CONSUMER_FORCE_FENCE`] once it asked the producer to go
    /// back to full fences.
    pub consumer_sleeping: Line<AtomicU32>,
    /// Producer-owned: records dropped because the ring was full.
    pub dropped: Line<AtomicU64>,
    /// Consumer-owned, a hint: one plus the CPU the consumer last ran on
    /// (0: none published). A producer that waits for the consumer's
    /// answer reads it to learn whether the two share a CPU. Added in
    /// minor version 1 and left out of the layout hash: either side may
    /// predate it (an older consumer leaves it 0).
    pub consumer_cpu: Line<AtomicU32>,
}

/// `producer_flags`: the producer's process is registered with
/// `MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED`, so it publishes with a compiler
/// fence only and the consumer issues the heavy barrier before sleeping.
pub const PRODUCER_ASYMMETRIC_FENCE: u32 = 1;
/// `consumer_sleeping`: the consumer is about to sleep or asleep.
pub const CONSUMER_SLEEPING: u32 = 1;
/// `consumer_sleeping`: the consumer's membarrier failed; the producer must
/// use a full fence after every commit from now on.
pub const CONSUMER_FORCE_FENCE: u32 = 2;

const _: () = assert!(size_of::<Header>() <= HEADER_SIZE);
const _: () = assert!(align_of::<Header>() == 128);

/// Decoded record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub len: u32,
    pub kind: u16,
    pub flags: u16,
    pub seq: u64,
}

impl RecordHeader {
    /// The first 8 bytes as one little-endian word.
    pub fn word0(&self) -> u64 {
        u64::from(self.len) | (u64::from(self.kind) << 32) | (u64::from(self.flags) << 48)
    }

    pub fn from_words(word0: u64, seq: u64) -> Self {
        RecordHeader {
            len: word0 as u32,
            kind: (word0 >> 32) as u16,
            flags: (word0 >> 48) as u16,
            seq,
        }
    }
}

/// Bytes a record of `payload_len` occupies in the ring, header included.
pub const fn record_footprint(payload_len: usize) -> usize {
    RECORD_HEADER_SIZE + payload_len.next_multiple_of(RECORD_ALIGN)
}

/// Largest payload a ring of `capacity` bytes accepts: a quarter of the
/// ring, so that a record plus the worst-case padding always fits twice.
pub const fn max_payload(capacity: u64) -> usize {
    (capacity / 4) as usize - RECORD_HEADER_SIZE
}

/// FNV-1a, usable in const context, for the layout fingerprint.
const fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x100_0000_01b3);
        i += 1;
    }
    hash
}

const fn mix(hash: u64, value: u64) -> u64 {
    fnv1a(hash, &value.to_le_bytes())
}

/// Fingerprint of everything both sides must agree on byte for byte: the
/// header offsets, the record framing, and rkyv's format features (endianness,
/// alignment of primitives, the width of relative pointers and lengths), each
/// observed from the compiled rkyv rather than assumed. The archived sizes of
/// the message types are folded in by [`kvedge_schema::messages::SCHEMA_FINGERPRINT`].
pub const fn layout_hash() -> u64 {
    let mut h = fnv1a(0xcbf2_9ce4_8422_2325, b"kvedge-ring");
    h = mix(h, HEADER_SIZE as u64);
    h = mix(h, RECORD_ALIGN as u64);
    h = mix(h, RECORD_HEADER_SIZE as u64);
    h = mix(h, offset_of!(Header, tail) as u64);
    h = mix(h, offset_of!(Header, head) as u64);
    h = mix(h, offset_of!(Header, consumer_sleeping) as u64);
    h = mix(h, offset_of!(Header, dropped) as u64);
    h = mix(h, offset_of!(Identity, layout_hash) as u64);
    h = mix(h, offset_of!(Identity, attach_epoch) as u64);
    h = mix(h, offset_of!(Identity, producer_flags) as u64);
    h = mix(h, PRODUCER_ASYMMETRIC_FENCE as u64);
    h = mix(h, CONSUMER_FORCE_FENCE as u64);
    // rkyv format features: pointer width, primitive alignment, endianness.
    h = mix(h, size_of::<rkyv::Archived<usize>>() as u64);
    h = mix(h, align_of::<rkyv::Archived<u64>>() as u64);
    h = mix(h, align_of::<rkyv::Archived<u32>>() as u64);
    // Endianness cannot be observed in const context; the workspace pins
    // rkyv's `little_endian` feature and `rkyv_format_is_the_pinned_one`
    // asserts the compiled byte order.
    h = fnv1a(h, b"rkyv-le");
    h = mix(h, kvedge_schema::messages::SCHEMA_FINGERPRINT);
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lines_are_128_bytes_apart() {
        assert_eq!(offset_of!(Header, tail), 128);
        assert_eq!(offset_of!(Header, head), 256);
        assert_eq!(offset_of!(Header, consumer_sleeping), 384);
        assert_eq!(offset_of!(Header, dropped), 512);
        assert_eq!(offset_of!(Header, consumer_cpu), 640);
    }

    #[test]
    fn record_header_round_trips() {
        let h = RecordHeader {
            len: 0xdead_beef,
            kind: 7,
            flags: 0x8001,
            seq: 42,
        };
        assert_eq!(RecordHeader::from_words(h.word0(), 42), h);
    }

    #[test]
    fn footprint_is_aligned() {
        assert_eq!(record_footprint(0), 16);
        assert_eq!(record_footprint(1), 32);
        assert_eq!(record_footprint(16), 32);
        assert_eq!(record_footprint(17), 48);
    }

    #[test]
    fn rkyv_format_is_the_pinned_one() {
        // pointer_width_32 and aligned are part of the wire format.
        assert_eq!(size_of::<rkyv::Archived<usize>>(), 4);
        assert_eq!(align_of::<rkyv::Archived<u64>>(), 8);
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&0x0102u16).unwrap();
        assert_eq!(&bytes[..], &[0x02, 0x01], "rkyv must be little-endian");
    }
}
