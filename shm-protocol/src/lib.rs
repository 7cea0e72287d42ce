//! `kvedge-shm`: the contract between GPU inference engines and the kvedge
//! daemon.
//!
//! Engines hand KV-cache block events and load to the daemon through a
//! single-producer single-consumer shared-memory [`ring`] of the rkyv
//! messages of `kvedge-schema`, created by the daemon as a sealed memfd ([`segment`]) and
//! passed over the [`control`] socket. The producer never blocks and never
//! allocates after warm-up ([`publisher`]); the consumer treats every byte in
//! shared memory as hostile. An engine's [`session`] with the daemon
//! (registering, heartbeats, resyncs, registering again after the daemon
//! restarts) is one state machine every engine driver runs. Frontends
//! that want select round trips without the kernel in the path attach a
//! query [`channel`]: the same rings, one each way.
//!
//! It also holds the project's one [`prefetch`] hint (Rust has no safe
//! one), which the KV index's walk uses, and the [`ratelimit`] every
//! driver's warnings go through.
//!
//! This crate has no async runtime: the daemon drives the consumer from its
//! own loop, engines call the publisher from theirs.

pub mod activation;
pub mod channel;
pub mod control;
pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod layout;
pub mod prefetch;
pub mod publisher;
pub mod ratelimit;
pub mod ring;
pub mod segment;
pub mod session;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use error::{ControlError, RingError, SegmentError};
pub use publisher::{PublishError, Publisher};
pub use ring::{Consumer, Fencing, Producer, Push, PushError, Record};
pub use session::{Link, Session};
