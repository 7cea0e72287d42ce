//! The pieces of kvedge's simulator that know nothing about the router or
//! about I/O: a model of a vLLM-style engine in virtual time
//! ([`engine::EngineModel`]), the workloads that drive it (the Mooncake
//! trace format and a seeded synthetic generator, [`workload`]), and the
//! statistics of a run ([`report`]). `kvedge sim` runs them against the real
//! router core; `kvedge mock-engine` runs the engine model in real time
//! behind a real ring.

#![forbid(unsafe_code)]

pub mod engine;
pub mod report;
pub mod workload;
