//! kvedge's tools around the daemon: `kvedge sim` (trace replay through
//! the real router in virtual time, with charts), `kvedge mock-engine` (the
//! engine model as a real process behind a real ring), `kvedge demo` (the
//! daemon, mock engines and a load generator on one machine) and `kvedge
//! publish` (KV events from JSON lines). The daemon does not depend on
//! this crate.

#![forbid(unsafe_code)]

pub mod demo;
pub mod mock_engine;
pub mod openai;
pub mod plot;
pub mod publish;
pub mod sim;
pub mod sim_cmd;
pub mod vllm_feed;
