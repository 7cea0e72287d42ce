//! `kvedge-schema`: what engines and the daemon agree on, apart from how it
//! travels. The rkyv [`messages`] an engine sends (KV block events, load,
//! heartbeats, snapshot brackets, notices, and the registration messages of
//! the control socket), their record-type numbers and checked decoding; and
//! block identity, the one [`hash`] implementation shared by engines, the
//! daemon, the CLI, the C library and the Python package.
//!
//! The shared-memory transport (`kvedge-shm`) carries these messages; the
//! routing core reads them. Neither I/O nor `unsafe` here.

#![forbid(unsafe_code)]

pub mod hash;
pub mod messages;

pub use messages::{DecodeError, Event, EventRef, Tier, decode};
