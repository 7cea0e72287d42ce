//! kvedge's bridge to engines that do not link libkvedge: vLLM, SGLang and
//! TensorRT-LLM publish KV-cache events over ZeroMQ as msgpack and their
//! load as Prometheus metrics. The bridge turns each engine rank into an
//! ordinary kvedge engine (a registration and a ring), so the routing core
//! needs nothing new.
//!
//! - [`msgpack`] and [`decode`]: the payload, both layouts, without
//!   allocating; [`encode`] writes it (mock engines, tests, benches).
//! - [`translate`]: the engine's block hashes to kvedge's, recomputed from
//!   token ids; mismatches counted, never indexed.
//! - [`feed`]: sequence numbers, gaps and replays, restarts, without I/O.
//! - [`scrape`]: the metrics text.
//! - [`driver`]: the sockets, timers and scrapes on a thread of its own.

#![forbid(unsafe_code)]

pub mod decode;
pub mod driver;
pub mod encode;
pub mod feed;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod msgpack;
pub mod scrape;
pub mod translate;

pub use driver::{Bridge, Settings};
