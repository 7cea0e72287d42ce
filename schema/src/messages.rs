//! Message schema v1: the rkyv types carried in ring records (KV events,
//! load, heartbeats, snapshot brackets) and on the control socket (Hello,
//! Welcome, Reject, ResyncRequest), their record-type numbers, and the
//! checked decoding of a record payload into an archived view.
//!
//! Decoding never deserializes into owned values: the daemon reads the
//! archived view in place, so consuming a record allocates nothing.

use rkyv::api::low::LowSerializer;
use rkyv::rancor;
use rkyv::ser::allocator::{Arena, ArenaHandle};
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

/// One record could not be decoded; the ring stays usable and the record is
/// skipped.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("unknown record type {0}")]
    UnknownType(u16),
    #[error("record type {kind} failed validation: {message}")]
    Invalid { kind: u16, message: String },
}

/// Serializer strategy used for every archive kvedge writes.
pub type Ser<'a> = LowSerializer<&'a mut AlignedVec, ArenaHandle<'a>, rancor::Error>;

/// Serializes `value` into `buf` (cleared first) using `arena` as scratch.
/// Allocates nothing once `buf` and `arena` have grown to the largest value.
pub fn encode<T>(value: &T, buf: &mut AlignedVec, arena: &mut Arena) -> Result<(), rancor::Error>
where
    T: for<'a> rkyv::Serialize<Ser<'a>>,
{
    buf.clear();
    rkyv::api::low::to_bytes_in_with_alloc::<_, _, rancor::Error>(value, buf, arena.acquire())?;
    Ok(())
}

/// KV cache tier of a block.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq, Clone, Copy))]
#[repr(u8)]
pub enum Tier {
    Device = 0,
    Host = 1,
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl ArchivedTier {
    pub fn to_native(self) -> Tier {
        match self {
            ArchivedTier::Device => Tier::Device,
            ArchivedTier::Host => Tier::Host,
            ArchivedTier::Disk => Tier::Disk,
        }
    }
}

/// Role of a worker in (dis)aggregated serving.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq, Clone, Copy))]
#[repr(u8)]
pub enum Role {
    Aggregated = 0,
    Prefill = 1,
    Decode = 2,
    Encode = 3,
}

impl Role {
    /// Every role, in the order of their codes.
    pub const ALL: [Role; 4] = [Role::Aggregated, Role::Prefill, Role::Decode, Role::Encode];

    /// The lowercase name used in configuration, JSON and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Encode => "encode",
        }
    }

    /// The role named `name` (as written by [`Role::as_str`]).
    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// The role with code `code` (its `repr(u8)` value).
    pub fn from_code(code: u8) -> Option<Role> {
        Role::ALL.get(usize::from(code)).copied()
    }
}

impl ArchivedRole {
    pub fn to_native(self) -> Role {
        match self {
            ArchivedRole::Aggregated => Role::Aggregated,
            ArchivedRole::Prefill => Role::Prefill,
            ArchivedRole::Decode => Role::Decode,
            ArchivedRole::Encode => Role::Encode,
        }
    }
}

/// One stored block: its chained sequence hash and its own local hash.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct StoredBlock {
    pub sequence_hash: u64,
    pub local_hash: u64,
}

/// Blocks became resident in `tier`, extending the chain after `parent`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct KvStored {
    pub parent: Option<u64>,
    pub blocks: Vec<StoredBlock>,
    pub tier: Tier,
    /// Block seed when hashed with a LoRA name or cache namespace (see
    /// [`crate::hash::block_seed`]); `None` for the plain seed 1337.
    pub salt: Option<u64>,
}

/// Blocks left `tier`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct KvRemoved {
    pub tier: Tier,
    pub hashes: Vec<u64>,
}

/// Every block of one tier (or of all tiers) is gone.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct KvCleared {
    /// `None` clears every tier.
    pub tier: Option<Tier>,
}

/// The engine's own view of its load: the truth the daemon projects from.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Load {
    pub active_requests: u32,
    pub waiting_requests: u32,
    /// Prompt tokens admitted and not yet prefilled; [`Load::NOT_MEASURED`]
    /// when the engine does not count them.
    pub active_prefill_tokens: u64,
    /// KV blocks of the requests running; [`Load::NOT_MEASURED`] when the
    /// engine does not count them.
    pub active_decode_blocks: u64,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    /// CLOCK_MONOTONIC nanoseconds at the engine when measured.
    pub timestamp_ns: u64,
}

impl Load {
    /// A token or block count the engine does not measure (an engine read
    /// from its Prometheus metrics, which give request counts only). The
    /// daemon then keeps counting what it reserved there itself, instead of
    /// letting the report reset it to 0.
    pub const NOT_MEASURED: u64 = u64::MAX;
}

/// Liveness beat (the open control connection is the primary signal; this
/// catches a hung engine).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Heartbeat {
    pub timestamp_ns: u64,
}

/// Starts a full snapshot: the consumer discards its view of this worker;
/// a Cleared(all) and Stored events for every held block follow.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct SnapshotBegin {
    pub snapshot_id: u64,
}

/// Ends the snapshot begun with the same id.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct SnapshotEnd {
    pub snapshot_id: u64,
    /// Blocks the producer published inside the bracket (a cross-check).
    pub blocks: u64,
}

/// Something about the engine's own feed that its operator should know
/// (a configuration mismatch, lost events): `count` times so far. Shown
/// per worker by the daemon; it changes no routing state. Consumers that do
/// not know this record type skip it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Notice {
    /// One of [`notice`]'s codes (others are shown by number).
    pub code: u16,
    pub count: u64,
    /// For people: what happened and how to fix it.
    pub message: String,
}

/// Notice codes.
pub mod notice {
    /// The engine's blocks are a different size from the configured one:
    /// its blocks are not indexed.
    pub const BLOCK_SIZE_MISMATCH: u16 = 1;
    /// Stored events carry no token ids, so kvedge cannot compute the
    /// blocks' hashes: they are not indexed.
    pub const NO_TOKEN_IDS: u16 = 2;
    /// A stored block's parent was never seen: it is not indexed.
    pub const UNKNOWN_PARENT: u16 = 3;
    /// A removal of a block never seen (ignored).
    pub const UNKNOWN_REMOVAL: u16 = 4;
    /// Blocks hashed with extra keys (multimodal inputs, cache salt) that
    /// a frontend's token ids cannot reproduce: not indexed.
    pub const EXTRA_KEYS: u16 = 5;
    /// Events of another KV cache group (ignored).
    pub const OTHER_GROUP: u16 = 6;
    /// A storage medium kvedge does not know (its events ignored).
    pub const UNKNOWN_MEDIUM: u16 = 7;
    /// A payload that does not decode (skipped).
    pub const UNDECODABLE: u16 = 8;
    /// An event type kvedge does not know (skipped).
    pub const UNKNOWN_EVENT: u16 = 9;
    /// The engine restarted (its sequence went back): its state was
    /// dropped and is rebuilt from its events.
    pub const RESTARTED: u16 = 10;
    /// Events went missing and were replayed.
    pub const REPLAYED: u16 = 11;
    /// Events went missing and could not be replayed: the engine's state
    /// was dropped rather than kept stale.
    pub const EVENTS_LOST: u16 = 12;
    /// Neither events nor load arrived within the heartbeat timeout: the
    /// engine's state was dropped.
    pub const SILENT: u16 = 13;
    /// The engine's load could not be read (its metrics endpoint).
    pub const LOAD_UNREADABLE: u16 = 14;
    /// The engine holds more blocks than the index may keep for it
    /// (`daemon.index_capacity`): further blocks are not indexed.
    pub const TOO_MANY_BLOCKS: u16 = 15;
    /// Batches from a peer that is not the engine's publisher (another
    /// connection to a bound events port, or one the engine's replay
    /// socket disowned): ignored.
    pub const FOREIGN_BATCHES: u16 = 16;
    /// A batch numbered back although the engine did not restart (its
    /// replay socket still holds later batches): ignored.
    pub const STALE_SEQUENCE: u16 = 17;
    /// Batches from a new publisher that the engine's replay socket could
    /// not vouch for because it did not answer: ignored.
    pub const UNVERIFIED_PUBLISHER: u16 = 18;
    /// Connections to a bound events port refused or cut off: an address
    /// not allowed, too many peers, a failed handshake, or a broken cap.
    pub const EVENTS_REFUSED: u16 = 19;

    /// Set on a code: the condition it names is over (the engine is heard
    /// again, its load is read again). The notice's `count` is the
    /// condition's final count; a later notice without the flag raises it
    /// again. Consumers that do not know the flag show an unknown code.
    pub const OVER: u16 = 0x8000;

    /// `code` as a notice that its condition is over.
    pub const fn over(code: u16) -> u16 {
        code | OVER
    }

    /// The condition a code names, and whether the notice says it is over.
    pub const fn split(code: u16) -> (u16, bool) {
        (code & !OVER, code & OVER != 0)
    }

    /// The code's name, as `workers` and the metrics show it (the same
    /// for a notice that says its condition is over).
    pub fn name(code: u16) -> &'static str {
        match split(code).0 {
            BLOCK_SIZE_MISMATCH => "block_size_mismatch",
            NO_TOKEN_IDS => "no_token_ids",
            UNKNOWN_PARENT => "unknown_parent",
            UNKNOWN_REMOVAL => "unknown_removal",
            EXTRA_KEYS => "extra_keys",
            OTHER_GROUP => "other_group",
            UNKNOWN_MEDIUM => "unknown_medium",
            UNDECODABLE => "undecodable",
            UNKNOWN_EVENT => "unknown_event",
            RESTARTED => "restarted",
            REPLAYED => "replayed",
            EVENTS_LOST => "events_lost",
            SILENT => "silent",
            LOAD_UNREADABLE => "load_unreadable",
            TOO_MANY_BLOCKS => "too_many_blocks",
            FOREIGN_BATCHES => "foreign_batches",
            STALE_SEQUENCE => "stale_sequence",
            UNVERIFIED_PUBLISHER => "unverified_publisher",
            EVENTS_REFUSED => "events_refused",
            _ => "other",
        }
    }
}

/// Record type numbers of ring messages.
pub mod kind {
    pub const KV_STORED: u16 = 1;
    pub const KV_REMOVED: u16 = 2;
    pub const KV_CLEARED: u16 = 3;
    pub const LOAD: u16 = 4;
    pub const HEARTBEAT: u16 = 5;
    pub const SNAPSHOT_BEGIN: u16 = 6;
    pub const SNAPSHOT_END: u16 = 7;
    pub const NOTICE: u16 = 8;
}

/// A ring message by value (what a producer publishes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stored(KvStored),
    Removed(KvRemoved),
    Cleared(KvCleared),
    Load(Load),
    Heartbeat(Heartbeat),
    SnapshotBegin(SnapshotBegin),
    SnapshotEnd(SnapshotEnd),
    Notice(Notice),
}

impl Event {
    /// The record type this event travels as.
    pub fn kind(&self) -> u16 {
        match self {
            Event::Stored(_) => kind::KV_STORED,
            Event::Removed(_) => kind::KV_REMOVED,
            Event::Cleared(_) => kind::KV_CLEARED,
            Event::Load(_) => kind::LOAD,
            Event::Heartbeat(_) => kind::HEARTBEAT,
            Event::SnapshotBegin(_) => kind::SNAPSHOT_BEGIN,
            Event::SnapshotEnd(_) => kind::SNAPSHOT_END,
            Event::Notice(_) => kind::NOTICE,
        }
    }

    /// This event's archive, as a ring record's payload carries it (an
    /// allocating convenience for tests and tools; the publisher encodes
    /// into retained buffers).
    pub fn to_payload(&self) -> AlignedVec {
        let mut buf = AlignedVec::new();
        let mut arena = Arena::new();
        let encoded = match self {
            Event::Stored(v) => encode(v, &mut buf, &mut arena),
            Event::Removed(v) => encode(v, &mut buf, &mut arena),
            Event::Cleared(v) => encode(v, &mut buf, &mut arena),
            Event::Load(v) => encode(v, &mut buf, &mut arena),
            Event::Heartbeat(v) => encode(v, &mut buf, &mut arena),
            Event::SnapshotBegin(v) => encode(v, &mut buf, &mut arena),
            Event::SnapshotEnd(v) => encode(v, &mut buf, &mut arena),
            Event::Notice(v) => encode(v, &mut buf, &mut arena),
        };
        encoded.expect("serializing into a vector cannot fail");
        buf
    }
}

/// A validated archived view of one ring record's payload.
#[derive(Debug, Clone, Copy)]
pub enum EventRef<'a> {
    Stored(&'a ArchivedKvStored),
    Removed(&'a ArchivedKvRemoved),
    Cleared(&'a ArchivedKvCleared),
    Load(&'a ArchivedLoad),
    Heartbeat(&'a ArchivedHeartbeat),
    SnapshotBegin(&'a ArchivedSnapshotBegin),
    SnapshotEnd(&'a ArchivedSnapshotEnd),
    Notice(&'a ArchivedNotice),
}

fn access<'a, T>(kind: u16, payload: &'a [u8]) -> Result<&'a T, DecodeError>
where
    T: rkyv::Portable
        + for<'b> rkyv::bytecheck::CheckBytes<rkyv::api::low::LowValidator<'b, rkyv::rancor::Error>>,
{
    rkyv::api::low::access::<T, rkyv::rancor::Error>(payload).map_err(|e| DecodeError::Invalid {
        kind,
        message: e.to_string(),
    })
}

/// Validates `payload` (which must be 16-byte aligned, as the consumer's
/// buffer is) as the archive of record type `kind`.
pub fn decode(kind: u16, payload: &[u8]) -> Result<EventRef<'_>, DecodeError> {
    Ok(match kind {
        kind::KV_STORED => EventRef::Stored(access(kind, payload)?),
        kind::KV_REMOVED => EventRef::Removed(access(kind, payload)?),
        kind::KV_CLEARED => EventRef::Cleared(access(kind, payload)?),
        kind::LOAD => EventRef::Load(access(kind, payload)?),
        kind::HEARTBEAT => EventRef::Heartbeat(access(kind, payload)?),
        kind::SNAPSHOT_BEGIN => EventRef::SnapshotBegin(access(kind, payload)?),
        kind::SNAPSHOT_END => EventRef::SnapshotEnd(access(kind, payload)?),
        kind::NOTICE => EventRef::Notice(access(kind, payload)?),
        other => return Err(DecodeError::UnknownType(other)),
    })
}

/// Control-socket messages.
pub mod control {
    use super::*;

    /// Control frame kinds.
    pub mod kind {
        pub const HELLO: u16 = 1;
        pub const WELCOME: u16 = 2;
        pub const REJECT: u16 = 3;
        pub const RESYNC_REQUEST: u16 = 4;
    }

    /// A free-form label attached to a worker (`key=value`).
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    pub struct Label {
        pub key: String,
        pub value: String,
    }

    /// Sent by an engine (one per data-parallel rank) to register.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    pub struct Hello {
        pub worker_id: u64,
        pub dp_rank: u32,
        pub model: String,
        pub role: Role,
        pub block_size: u32,
        /// Total KV blocks per tier: device, host, disk.
        pub kv_blocks: [u64; 3],
        pub labels: Vec<Label>,
        pub taints: Vec<String>,
        /// Where frontends send requests for this worker (URL or socket path).
        pub endpoint: String,
        /// Ring capacity the engine asks for (0 = daemon default).
        pub ring_capacity: u64,
    }

    impl Hello {
        /// Worker `worker_id` (data-parallel rank 0) serving `model`:
        /// aggregated, 16-token blocks, no cache size reported, no labels
        /// or taints, no endpoint, the daemon's ring size. Set the rest
        /// with struct update syntax:
        /// `Hello { endpoint: url, ..Hello::new(7, "llama") }`.
        pub fn new(worker_id: u64, model: impl Into<String>) -> Hello {
            Hello {
                worker_id,
                dp_rank: 0,
                model: model.into(),
                role: Role::Aggregated,
                block_size: 16,
                kv_blocks: [0; 3],
                labels: Vec::new(),
                taints: Vec::new(),
                endpoint: String::new(),
                ring_capacity: 0,
            }
        }
    }

    /// The daemon accepted the registration; the ring memfd and its wake
    /// eventfd ride along as SCM_RIGHTS.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    pub struct Welcome {
        pub worker_id: u64,
        pub dp_rank: u32,
        pub attach_epoch: u64,
        pub ring_capacity: u64,
        /// The engine must send a Heartbeat or any record but a Notice at
        /// least this often.
        pub heartbeat_interval_ms: u32,
    }

    /// The daemon refused the registration.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    pub struct Reject {
        pub code: u32,
        pub message: String,
    }

    /// The daemon lost events (a ring gap) and asks for a full snapshot.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    pub struct ResyncRequest {
        pub snapshot_id: u64,
        /// First sequence number the daemon is missing.
        pub missing_from_seq: u64,
    }

    /// Reject codes.
    pub mod reject {
        pub const DUPLICATE_WORKER: u32 = 1;
        pub const NOT_PERMITTED: u32 = 2;
        pub const INVALID_HELLO: u32 = 3;
        pub const TOO_MANY_WORKERS: u32 = 4;
        pub const INTERNAL: u32 = 5;
        /// The connection was closed before its Hello was read: newer
        /// connections of the same uid took its place, or the registration
        /// deadline passed. Connecting again is the answer.
        pub const DISPLACED: u32 = 6;
    }
}

const fn fold(h: u64, v: usize) -> u64 {
    (h ^ v as u64).wrapping_mul(0x100_0000_01b3)
}

/// Folds the archived size and alignment of every ring message into the
/// layout hash, so a schema change that moves bytes changes the fingerprint.
pub const SCHEMA_FINGERPRINT: u64 = {
    use std::mem::{align_of, size_of};
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    h = fold(h, size_of::<ArchivedKvStored>());
    h = fold(h, align_of::<ArchivedKvStored>());
    h = fold(h, size_of::<ArchivedStoredBlock>());
    h = fold(h, size_of::<ArchivedKvRemoved>());
    h = fold(h, size_of::<ArchivedKvCleared>());
    h = fold(h, size_of::<ArchivedLoad>());
    h = fold(h, size_of::<ArchivedHeartbeat>());
    h = fold(h, size_of::<ArchivedSnapshotBegin>());
    h = fold(h, size_of::<ArchivedSnapshotEnd>());
    fold(h, size_of::<control::ArchivedHello>())
};
