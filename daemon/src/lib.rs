//! kvedge's daemon: the drivers that feed the routing core
//! ([`kvedge_core::Core`]) and `kvedge run` as a service.
//!
//! - [`server`]: the routing thread, one epoll loop that owns the core and
//!   serves `engines` (`control.sock` and their rings), `clients`
//!   (`query.sock` and query channels) and [`jobs`] (work from drivers on
//!   other threads), carrying out what the core asks.
//! - `dispatch`: a request's bytes to its reply's bytes, for every
//!   transport.
//! - `uring` (feature `io-uring`): query.sock on io_uring, a driver on
//!   its own thread that feeds the routing thread through [`jobs`].
//! - [`service`]: logging, sockets (bound or passed by systemd), signals,
//!   sd_notify, the metrics listener; [`config`] loads the file.

#![forbid(unsafe_code)]
#![deny(clippy::disallowed_methods)]

mod clients;
pub mod config;
mod dispatch;
mod engines;
pub mod epp;
pub mod jobs;
pub mod listen;
pub mod metrics_http;
pub mod notify;
mod poller;
mod reload;
pub mod server;
pub mod service;
#[cfg(feature = "io-uring")]
pub mod uring;

pub use reload::Reloader;
pub use server::{RuntimeDir, Server};
