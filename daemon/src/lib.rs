//! kvedge's per-node routing daemon: the KV index, load accounting, the
//! router core, the event loop behind `kvedge run` with its control and query
//! sockets, and the command line ([`cli::main_with_registry`] is the
//! embedding entry point for binaries with extra policies).

#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod demo;
pub mod framing;
pub mod human;
pub mod index;
pub mod latency;
pub mod load;
pub mod metrics;
pub mod mock_engine;
pub mod notify;
pub mod plot;
pub mod publish;
pub mod router;
pub mod server;
pub mod service;
pub mod sim;
pub mod sim_cmd;
#[cfg(feature = "io-uring")]
pub mod uring;
/// The binary query protocol (the `kvedge-wire` crate, shared with the C
/// library).
pub use kvedge_wire as wire;
