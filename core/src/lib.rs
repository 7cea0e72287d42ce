//! kvedge's routing core, without I/O: [`Core`] owns the worker registry,
//! the KV index, load accounting, the router that runs worker selection and
//! the rule language over them, reservations and counters. Drivers (the
//! daemon's epoll loop, its io_uring listener, any future transport) feed
//! it events and requests and carry out what it asks; time always comes
//! from them. Nothing here reads a clock, opens a socket or a file, starts
//! a thread or prints (the crate's `.clippy.toml` and the lints below make
//! each an error); it logs through `tracing`.

#![forbid(unsafe_code)]
#![deny(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    clippy::print_stdout,
    clippy::print_stderr
)]

mod answer;
mod chunk_queue;
mod client;
mod core;
mod counters;
mod engine;
pub mod index;
pub mod latency;
pub mod load;
mod mask_table;
pub mod metrics;
pub mod pacing;
pub mod pending;
pub mod prefill_watch;
pub mod recent;
pub mod router;
mod table;
mod warm;
mod warn;

pub use crate::core::{
    Core, HEARTBEAT_INTERVAL_MS, MAX_PENDING_PER_UID, MAX_PENDING_REGISTRATIONS, Output,
    REGISTRATION_DEADLINE, RESYNC_ANSWER_DEADLINE, RegistrationError,
};
pub use answer::{ReloadError, RingsGrant};
pub use client::{ClientDrop, ClientId};
pub use engine::{EngineId, EngineState};
