//! Engines kvedge can be tried and tested against without a GPU:
//! `kvedge mock-engine` (the simulator's engine model as a real process,
//! publishing through a ring as libkvedge engines do, or as vLLM does over
//! ZeroMQ and Prometheus, and serving the OpenAI endpoints over HTTP) and
//! `kvedge publish` (an engine that publishes KV events from JSON lines).
//! The daemon does not depend on this crate.

#![forbid(unsafe_code)]

pub mod engine_args;
mod metrics_page;
pub mod mock_engine;
pub mod openai;
pub mod publish;
pub mod vllm_feed;
pub mod vllm_hash;

pub use engine_args::EngineArgs;
