//! kvedge's routing core, without I/O: the KV index, load accounting, the
//! router that runs worker selection and the rule language over them, the
//! configuration they are built from, and the metrics they report. Time
//! always comes from the caller; nothing here reads a clock, opens a
//! socket or starts a thread.

#![forbid(unsafe_code)]

pub mod config;
pub mod index;
pub mod latency;
pub mod load;
pub mod metrics;
pub mod router;
