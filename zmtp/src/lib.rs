//! ZeroMQ's wire protocol (ZMTP 3.x with NULL security) for the sockets
//! kvedge speaks with unmodified engines: a SUB reading an engine's KV
//! events (connecting to its PUB, or bound for engines that connect), a
//! DEALER asking its replay ROUTER, and, for mock engines and tests, a
//! PUB and a ROUTER.
//!
//! Written here rather than taken from a crate because every network port
//! is hostile: the pure-Rust `zeromq` crate reserves whatever length a
//! frame header declares and panics on some peer behaviour, and libzmq's
//! `ZMQ_MAXMSGSIZE` caps a frame but not a message's frame count, while
//! bringing a C build and threads of its own. Here every declared size
//! meets a cap before anything is allocated ([`codec`]), a peer that
//! breaks one is disconnected and counted, no peer input panics, and a
//! bound socket takes peers only from the addresses it allows and only as
//! many as it is told ([`Sub::bind`]).
//!
//! - [`codec`]: greeting, handshake commands and frames, without I/O.
//! - [`Sub`], [`Dealer`], [`Pub`], [`Router`]: the sockets, on tokio.

#![forbid(unsafe_code)]

pub mod codec;
mod conn;
mod endpoint;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
mod peers;
mod publish;
mod router;
mod sub;

pub use codec::{Limits, ProtocolError, SocketType};
pub use conn::Peer;
pub use endpoint::{Endpoint, PeerAddr};
pub use peers::{Allow, Options, PeerId, Stats};
pub use publish::Pub;
pub use router::Router;
pub use sub::{Dealer, Sub, SubEvent};

/// Why a connection or a socket operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    #[error("{0} took too long")]
    Timeout(&'static str),
    #[error("the peer closed the connection")]
    Closed,
    #[error("{0}")]
    Endpoint(String),
}

impl Error {
    /// Whether the peer broke the protocol or a cap (rather than going
    /// away or being slow).
    pub fn is_protocol(&self) -> bool {
        matches!(self, Error::Protocol(_))
    }
}
