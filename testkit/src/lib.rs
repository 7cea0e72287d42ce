//! What kvedge's tests and benches share, so that none writes it again:
//! a daemon bound and run in this process ([`daemon`]), engines
//! registered over its control socket ([`engine`]), and the percentiles
//! the latency figures are read from ([`stats`]). A dev-dependency only;
//! it panics where a test would.

#![forbid(unsafe_code)]

pub mod daemon;
pub mod engine;
pub mod stats;

pub use daemon::{Bound, Running, config, temp_dir};
pub use engine::register;
pub use stats::Percentiles;
