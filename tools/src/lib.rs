//! The commands that show kvedge at work: `kvedge sim` (trace replay
//! through the real router in virtual time, with charts) and `kvedge demo`
//! (the daemon, mock engines from `kvedge-mock` and a load generator on
//! one machine). The daemon does not depend on this crate.

#![forbid(unsafe_code)]

pub mod demo;
pub mod plot;
pub mod sim;
pub mod sim_cmd;
