//! kvedge's daemon: the event loop behind `kvedge run` with its control and
//! query sockets, the optional io_uring listener, and the service around
//! them (logging, signals, systemd notification, the metrics listener).

#![forbid(unsafe_code)]

pub mod config;
pub mod framing;
pub mod metrics_http;
pub mod notify;
pub mod server;
pub mod service;
#[cfg(feature = "io-uring")]
pub mod uring;
