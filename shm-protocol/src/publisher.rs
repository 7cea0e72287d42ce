//! The engine-side publisher: turns KV events and load into ring records
//! without blocking and, after warm-up, without allocating (message scratch,
//! serializer buffer and arena are all reused). It also brackets resync
//! snapshots and answers the daemon's resync requests.

use std::path::Path;
use std::time::{Duration, Instant};

use rkyv::rancor;
use rkyv::ser::allocator::Arena;
use rkyv::util::AlignedVec;

use crate::control::ProducerSession;
use crate::error::ControlError;
use crate::ring::{Fencing, Producer, Push, PushError};
use kvedge_schema::hash;
use kvedge_schema::messages::control::{Hello, ResyncRequest};
use kvedge_schema::messages::{
    Heartbeat, KvCleared, KvRemoved, KvStored, Load, Notice, SnapshotBegin, SnapshotEnd,
    StoredBlock, Tier, kind,
};
use kvedge_schema::messages::{Ser, encode};

/// How long a snapshot's record waits for room in a full ring before it
/// is dropped. A snapshot larger than the ring streams through it at the
/// daemon's pace; only a daemon that stops reading this long makes it
/// drop (the daemon then asks for the snapshot again).
pub const SNAPSHOT_STALL: Duration = Duration::from_secs(2);

/// Why a publish call did nothing at all (a dropped record is not an error:
/// it is a [`Push::Dropped`] the daemon will resync).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Ring(#[from] PushError),
    #[error("serializing the event failed: {0}")]
    Encode(rancor::Error),
    #[error("block size must be positive")]
    ZeroBlockSize,
    #[error("no snapshot is open")]
    NoSnapshot,
}

/// Publishes one engine's (one dp rank's) events into its ring.
pub struct Publisher {
    session: Option<ProducerSession>,
    ring: Producer,
    buf: AlignedVec,
    arena: Arena,
    stored: KvStored,
    removed: KvRemoved,
    hashes: Vec<(u64, u64)>,
    snapshot: Option<(u64, u64)>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("session", &self.session)
            .field("ring", &self.ring)
            .field("snapshot", &self.snapshot)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Registers with the daemon at `control_socket` and returns a publisher.
    pub fn connect(
        control_socket: impl AsRef<Path>,
        hello: &Hello,
        timeout: Duration,
    ) -> Result<Self, ControlError> {
        Self::connect_with(control_socket, hello, timeout, Fencing::Asymmetric)
    }

    /// [`Publisher::connect`], with the ring's commits fenced as `fencing`
    /// says.
    pub fn connect_with(
        control_socket: impl AsRef<Path>,
        hello: &Hello,
        timeout: Duration,
        fencing: Fencing,
    ) -> Result<Self, ControlError> {
        let (session, ring) =
            ProducerSession::connect_with(control_socket, hello, timeout, fencing)?;
        Ok(Self::new(Some(session), ring))
    }

    /// A publisher over an existing ring (tests, benches, custom transports).
    pub fn new(session: Option<ProducerSession>, ring: Producer) -> Self {
        Publisher {
            session,
            ring,
            buf: AlignedVec::with_capacity(4096),
            arena: Arena::new(),
            stored: KvStored {
                parent: None,
                blocks: Vec::with_capacity(64),
                tier: Tier::Device,
                salt: None,
            },
            removed: KvRemoved {
                tier: Tier::Device,
                hashes: Vec::with_capacity(64),
            },
            hashes: Vec::new(),
            snapshot: None,
        }
    }

    /// The control session, when registered through a daemon.
    pub fn session(&self) -> Option<&ProducerSession> {
        self.session.as_ref()
    }

    /// The ring producer (sequence numbers, drop count).
    pub fn ring(&self) -> &Producer {
        &self.ring
    }

    /// Records dropped because the ring was full.
    pub fn dropped(&self) -> u64 {
        self.ring.dropped()
    }

    fn push<T>(&mut self, kind: u16, value: &T) -> Result<Push, PublishError>
    where
        T: for<'a> rkyv::Serialize<Ser<'a>>,
    {
        encode(value, &mut self.buf, &mut self.arena).map_err(PublishError::Encode)?;
        self.commit(kind)
    }

    fn push_stored(&mut self) -> Result<Push, PublishError> {
        encode(&self.stored, &mut self.buf, &mut self.arena).map_err(PublishError::Encode)?;
        if let Some((_, n)) = &mut self.snapshot {
            *n += self.stored.blocks.len() as u64;
        }
        self.commit(kind::KV_STORED)
    }

    /// Pushes the encoded record in `buf`. Outside a snapshot it never
    /// waits (a full ring drops it, and the daemon resyncs). Inside one it
    /// waits for room, at most [`SNAPSHOT_STALL`] per record: a snapshot
    /// is the engine's whole state, larger than the ring when the engine
    /// holds many blocks, and dropping any of it would only make the daemon
    /// ask for all of it again.
    fn commit(&mut self, kind: u16) -> Result<Push, PublishError> {
        if self.snapshot.is_some() && self.buf.len() <= self.ring.max_payload() {
            self.wait_for_room();
        }
        Ok(self.ring.try_push(kind, 0, &self.buf)?)
    }

    /// Waits until the record in `buf` fits, the consumer broke the ring,
    /// or [`SNAPSHOT_STALL`] passes without room.
    fn wait_for_room(&mut self) {
        let len = self.buf.len();
        if self.ring.has_room_for(len) {
            return;
        }
        let start = Instant::now();
        let mut spins = 0u32;
        while !self.ring.has_room_for(len) && !self.ring.consumer_broken() {
            if start.elapsed() >= SNAPSHOT_STALL {
                return;
            }
            // The daemon drains thousands of records per turn: a short
            // spin usually finds room; past it, yield the CPU.
            if spins < 64 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Blocks became resident in `tier` after `parent`.
    pub fn publish_stored(
        &mut self,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
        salt: Option<u64>,
    ) -> Result<Push, PublishError> {
        self.stored.parent = parent;
        self.stored.tier = tier;
        self.stored.salt = salt;
        self.stored.blocks.clear();
        self.stored.blocks.extend_from_slice(blocks);
        self.push_stored()
    }

    /// Like [`Publisher::publish_stored`] from sequence hashes alone (local
    /// hashes unknown, sent as 0).
    pub fn publish_stored_hashes(
        &mut self,
        tier: Tier,
        parent: Option<u64>,
        sequence_hashes: &[u64],
    ) -> Result<Push, PublishError> {
        self.stored.parent = parent;
        self.stored.tier = tier;
        self.stored.salt = None;
        self.stored.blocks.clear();
        self.stored
            .blocks
            .extend(sequence_hashes.iter().map(|&sequence_hash| StoredBlock {
                sequence_hash,
                local_hash: 0,
            }));
        self.push_stored()
    }

    /// Hashes the full blocks of `tokens` (continuing after `parent`) and
    /// publishes them. `seed` is [`hash::block_seed`] of the request's LoRA
    /// and namespace.
    pub fn publish_stored_tokens(
        &mut self,
        tier: Tier,
        parent: Option<u64>,
        tokens: &[u32],
        block_size: usize,
        seed: u64,
    ) -> Result<Push, PublishError> {
        if block_size == 0 {
            return Err(PublishError::ZeroBlockSize);
        }
        let n = hash::full_blocks(tokens.len(), block_size);
        self.hashes.resize(n, (0, 0));
        hash::hash_blocks_into(tokens, block_size, seed, parent, &mut self.hashes);
        self.stored.parent = parent;
        self.stored.tier = tier;
        self.stored.salt = (seed != hash::SEED).then_some(seed);
        self.stored.blocks.clear();
        self.stored
            .blocks
            .extend(
                self.hashes
                    .iter()
                    .map(|&(sequence_hash, local_hash)| StoredBlock {
                        sequence_hash,
                        local_hash,
                    }),
            );
        self.push_stored()
    }

    /// Blocks left `tier`.
    pub fn publish_removed(&mut self, tier: Tier, hashes: &[u64]) -> Result<Push, PublishError> {
        self.removed.tier = tier;
        self.removed.hashes.clear();
        self.removed.hashes.extend_from_slice(hashes);
        encode(&self.removed, &mut self.buf, &mut self.arena).map_err(PublishError::Encode)?;
        Ok(self.ring.try_push(kind::KV_REMOVED, 0, &self.buf)?)
    }

    /// Every block of `tier` (or of every tier, for `None`) is gone.
    pub fn publish_cleared(&mut self, tier: Option<Tier>) -> Result<Push, PublishError> {
        self.push(kind::KV_CLEARED, &KvCleared { tier })
    }

    /// The engine's current load.
    pub fn publish_load(&mut self, load: &Load) -> Result<Push, PublishError> {
        self.push(kind::LOAD, load)
    }

    /// A notice about this engine's feed (see [`kvedge_schema::messages::notice`]):
    /// `code` has happened `count` times so far.
    pub fn publish_notice(
        &mut self,
        code: u16,
        count: u64,
        message: &str,
    ) -> Result<Push, PublishError> {
        let notice = Notice {
            code,
            count,
            message: message.to_owned(),
        };
        self.push(kind::NOTICE, &notice)
    }

    /// A liveness beat.
    pub fn heartbeat(&mut self, timestamp_ns: u64) -> Result<Push, PublishError> {
        self.push(kind::HEARTBEAT, &Heartbeat { timestamp_ns })
    }

    /// Opens a snapshot: SnapshotBegin then Cleared(all). The engine then
    /// publishes Stored for every block it holds and calls
    /// [`Publisher::end_snapshot`].
    pub fn begin_snapshot(&mut self, snapshot_id: u64) -> Result<Push, PublishError> {
        self.snapshot = Some((snapshot_id, 0));
        let first = self.push(kind::SNAPSHOT_BEGIN, &SnapshotBegin { snapshot_id })?;
        let second = self.publish_cleared(None)?;
        Ok(match (first, second) {
            (Push::Dropped { seq }, _) | (_, Push::Dropped { seq }) => Push::Dropped { seq },
            (c, _) => c,
        })
    }

    /// Closes the open snapshot.
    pub fn end_snapshot(&mut self) -> Result<Push, PublishError> {
        let (snapshot_id, blocks) = self.snapshot.take().ok_or(PublishError::NoSnapshot)?;
        self.push(
            kind::SNAPSHOT_END,
            &SnapshotEnd {
                snapshot_id,
                blocks,
            },
        )
    }

    /// Checks the control connection for a resync request (non-blocking).
    pub fn poll(&mut self) -> Result<Option<ResyncRequest>, ControlError> {
        match &mut self.session {
            Some(s) => s.poll(),
            None => Ok(None),
        }
    }

    /// Serves a pending resync request, if any, by bracketing a snapshot
    /// around `republish`, which must publish every block the engine holds.
    /// Returns whether a snapshot was sent. Inside the snapshot a full
    /// ring makes the publisher wait for room (see [`SNAPSHOT_STALL`]), so
    /// a snapshot of any size arrives whole.
    pub fn serve_resync(
        &mut self,
        republish: impl FnOnce(&mut Publisher) -> Result<(), PublishError>,
    ) -> Result<bool, ControlError> {
        let Some(req) = self.poll()? else {
            return Ok(false);
        };
        let result = self
            .begin_snapshot(req.snapshot_id)
            .and_then(|_| republish(self))
            .and_then(|_| self.end_snapshot());
        // A failure inside the bracket means an incomplete snapshot; the
        // daemon sees the gap or the missing end and asks again.
        let _ = result;
        Ok(true)
    }
}
