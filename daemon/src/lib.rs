//! kvedge's per-node routing daemon. This crate grows with issue 5; today it
//! holds the KV index (which workers hold which blocks, and the per-request
//! prefix-overlap query) and the `kvedge` command line's offline tools
//! (`hash`, `check-config`).

#![forbid(unsafe_code)]

pub mod config;
pub mod index;
pub mod load;
pub mod router;
pub mod server;
