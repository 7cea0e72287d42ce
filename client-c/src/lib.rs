//! kvedge's C library: `libkvedge.so` / `libkvedge.a` with the header
//! `include/kvedge.h` (generated from this crate by a pinned cbindgen).
//!
//! Three parts, each a thin layer over the Rust crates so the C and Rust
//! paths cannot drift apart:
//! - the engine-side publisher ([`kvedge_publisher_open`] ...): registration
//!   over `control.sock` and KV events / load into the shared-memory ring
//!   (`kvedge_shm::Publisher`);
//! - block hashing ([`kvedge_hash_blocks`]), the same function `kvedge hash`
//!   and the daemon use;
//! - the frontend query client ([`kvedge_client_connect`] ...), the binary
//!   protocol's client (`kvedge_wire::Client`).
//!
//! Conventions, as in rustls-ffi: every function returns a `kvedge_status`
//! (0 is success) or a plain value, checks every pointer, and runs behind a
//! panic boundary; the message of the last failure on the calling thread
//! is `kvedge_last_error_message`.

#![allow(non_camel_case_types)]

mod boundary;
mod client;
mod hashing;
mod publisher;
mod status;

pub use boundary::{kvedge_last_error_message, kvedge_strerror, kvedge_version};
pub use client::*;
pub use hashing::*;
pub use publisher::*;
pub use status::*;
