//! Typed errors of the shared-memory contract: one enum per layer (segment,
//! ring, control handshake; record decoding's is the schema's), so callers can tell a hostile
//! producer from a transient condition without parsing strings.

use std::io;

/// Creating, sealing, mapping or validating a ring segment failed.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error("ring capacity {0} bytes is invalid: it must be a power of two between {min} and {max}", min = crate::layout::MIN_CAPACITY, max = crate::layout::MAX_CAPACITY)]
    InvalidCapacity(u64),
    #[error("segment has {actual} bytes but its header describes {expected}")]
    WrongSize { expected: u64, actual: u64 },
    #[error("segment magic is {found:#018x}, not a kvedge ring ({expected:#018x})")]
    BadMagic { found: u64, expected: u64 },
    #[error(
        "ring protocol version {found_major}.{found_minor} is incompatible with this library's {major}.{minor}"
    )]
    IncompatibleVersion {
        found_major: u16,
        found_minor: u16,
        major: u16,
        minor: u16,
    },
    #[error(
        "ring layout hash {found:#018x} differs from this library's {expected:#018x} (different record layout or rkyv format features)"
    )]
    LayoutMismatch { found: u64, expected: u64 },
    #[error("segment is not sealed against shrinking and growing (seals {0:#x})")]
    NotSealed(u32),
    #[error("ring is not fresh: tail {tail} and head {head} must both be zero at attach")]
    NotFresh { tail: u64, head: u64 },
    #[error("{op}: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl SegmentError {
    pub(crate) fn os(op: &'static str, source: impl Into<io::Error>) -> Self {
        SegmentError::Os {
            op,
            source: source.into(),
        }
    }
}

/// The ring itself can no longer be trusted: framing was lost, so the consumer
/// must drop the producer (the daemon disconnects it). Sticky once returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error("producer tail {tail} is out of range for head {head} and capacity {capacity}")]
    TailOutOfRange { tail: u64, head: u64, capacity: u64 },
    #[error("producer tail {0} is not 16-byte aligned")]
    TailMisaligned(u64),
    #[error("record at {pos} claims {len} payload bytes; only {available} are committed")]
    RecordOverrun { pos: u64, len: u64, available: u64 },
    #[error("record at {pos} claims {len} payload bytes, above the limit of {limit}")]
    RecordTooLarge { pos: u64, len: u64, limit: u64 },
    #[error("record at {pos} would cross the end of the ring ({len} payload bytes)")]
    RecordSplit { pos: u64, len: u64 },
    #[error("padding record at {pos} does not reach the end of the ring")]
    BadPadding { pos: u64 },
    #[error("record carries sequence number u64::MAX, which no producer can reach")]
    SequenceExhausted,
    #[error("sequence number went backwards: expected at least {expected}, got {found}")]
    SequenceRegression { expected: u64, found: u64 },
}

/// Errors of the control-socket handshake and framing.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket I/O: {0}")]
    Io(#[from] io::Error),
    #[error("peer closed the control connection")]
    Closed,
    #[error("control frame of {len} bytes exceeds the limit of {limit}")]
    FrameTooLarge { len: u32, limit: u32 },
    #[error("control protocol version {found} is not supported (this side speaks {supported})")]
    Version { found: u16, supported: u16 },
    #[error("unexpected control message kind {found} (expected {expected})")]
    Unexpected { found: u16, expected: &'static str },
    #[error("control message kind {kind} failed validation: {message}")]
    Invalid { kind: u16, message: String },
    #[error("expected {expected} file descriptors with the message, got {got}")]
    MissingFds { expected: usize, got: usize },
    #[error("daemon refused registration (code {code}): {message}")]
    Rejected { code: u32, message: String },
    #[error(transparent)]
    Segment(#[from] SegmentError),
}

impl ControlError {
    /// The daemon closed a registration before reading its Hello (told
    /// [`DISPLACED`](kvedge_schema::messages::control::reject::DISPLACED), or the
    /// connection found closed or reset): connecting again may succeed.
    pub fn is_displaced(&self) -> bool {
        match self {
            ControlError::Rejected { code, .. } => {
                *code == kvedge_schema::messages::control::reject::DISPLACED
            }
            ControlError::Closed => true,
            ControlError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }
}
