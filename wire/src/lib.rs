//! kvedge's query protocol, once: what a frontend asks ([`Request`]), what
//! the daemon answers ([`Reply`], [`Status`]), and their two encodings on
//! `query.sock`. A connection that starts with the 4 bytes `KVE1` speaks
//! binary frames ([`binary`], for programs); anything else speaks JSON
//! lines ([`json`], for people and scripts; the `json` feature). Both
//! decode into the same [`Request`], which the routing core answers once.
//!
//! **Binary frames.** Every frame, both ways: `len: u32 | op or status:
//! u16 | version: u16 | payload`, little-endian, where `len` counts
//! everything after itself.
//!
//! | op | request payload | reply payload (status 0) |
//! |---|---|---|
//! | 1 select | `flags: u8` (bit 0 dry run, bit 1 ids are token ids rather than sequence hashes, bit 2 the request context follows the ids, bit 3 a subset follows, bit 4 the hashes are approximate: of text chunks, never with bit 1, bit 5 the routing block follows, bit 6 the prompt's text follows), `role: u8` (0 aggregated, 1 prefill, 2 decode, 3 encode), `model_len: u16`, model, `session_len: u16`, session (0 = none), `prompt_tokens: u32` (0 = from the ids), `count: u32`, then `count` ids (`u32` tokens or `u64` hashes); with bit 2: `priority: i32`, `tenant_len: u16`, tenant (0 = none), `tag_count: u16` then each `len: u16`, tag, `header_count: u16` then each `name_len: u16`, name, `value_len: u16`, value; with bit 3: `subset_count: u16` (at most 1,024) then each `len: u16`, endpoint; with bit 5 (after the subset): `trigger: u8` (0 a user's message, 1 a tool's result, 2 other), `final: u8` (1: the session's last turn), `has_target: u8` (1: serve on exactly the worker that follows), `target_worker_id: u64`, `target_dp_rank: u32`, `parent_len: u16`, parent session (0 = none), `toleration_count: u16` (at most 32) then each `len: u16`, toleration (`key` or `key=value`); trigger, final and parent need a session; with bit 6 (last): `text_len: u32`, the prompt's text (UTF-8), for the rules' regex classifier | `worker_id: u64`, `dp_rank: u32`, `request_id: u64`, `cost: f64` (NaN: none), overlap `device, host, disk: u32`, `flags: u8` (bit 0: a provider, not a worker; bit 1: the provider's name follows), `endpoint_len: u16`, endpoint; with bit 1: `name_len: u16`, the provider's name |
//! | 2 prefill_done | `request_id: u64` | empty |
//! | 3 finish | `request_id: u64` | empty |
//! | 5 abort | `request_id: u64`: the dispatch failed before a response stream; released, and its session's binding put back | empty |
//! | 4 attach_rings | empty | `capacity: u64`, with four descriptors attached (SCM_RIGHTS): see below |
//!
//! A non-zero status is an error, its payload the message (UTF-8); the
//! codes are [`Status::code`]. A frame longer than the daemon's
//! `max_frame_bytes` gets `FrameTooLarge` and the connection is closed;
//! any other bad frame gets its error and the connection stays usable.
//!
//! **JSON lines.** One object per line each way:
//!
//! ```text
//! {"op":"select","model":"m","tokens":[1,2,3],"role":"aggregated","session":"s","dry_run":false}
//! {"op":"select","model":"m","hashes":[123,456],"explain":true}
//! {"op":"prefill_done","request_id":7}   {"op":"finish","request_id":7}
//! {"op":"workers"}   {"op":"stats"}   {"op":"metrics"}   {"op":"reload"}
//! ```
//!
//! An error comes back as `{"error":{"code":...,"message":...}}`, the code
//! being [`Status::name`]. A bad line gets its error and the connection
//! stays usable; a line longer than the frame limit closes it.
//!
//! **Rings.** `attach_rings` moves a connection's requests off the socket:
//! the daemon answers with the descriptors of a query channel
//! ([`kvedge_shm::channel`]), a request ring and a reply ring of `capacity`
//! bytes each. From then on the client may put any request frame body (the
//! frame without its length) into the request ring as one record and reads
//! its reply frame body from the reply ring, one request in flight at a
//! time; the socket still works and stays open, as the liveness signal both
//! ways. A request larger than a quarter of the ring goes over the socket.
//! A daemon that cannot attach (its limit reached, or a listener that does
//! not support it) answers `RingsUnavailable`; the connection is unchanged.
//!
//! A crate of its own (std, rustix and the shm contract; serde only with
//! the `json` feature) so that the C library links the client without the
//! daemon's dependencies.

#![forbid(unsafe_code)]
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod binary;
mod client;
pub mod framing;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
#[cfg(feature = "json")]
pub mod json;
mod reply;
mod request;
mod status;

pub use binary::{MAGIC, VERSION, op};
pub use client::{Client, MAX_REPLY_BYTES, Outcome};
pub use reply::{
    DecisionRow, ErrorReply, ExplainedWorker, Explanation, LatencySummary, Reply, SelectReply,
    SelectView, Selected, Stats, TtftExplained, WorkerNotice, WorkerRow,
};
pub use request::{
    Ids, MAX_SUBSET, MAX_TAGS, MAX_TOLERATIONS, Pairs, Request, Role, Select, Strs, Target,
    Trigger, Word, Words,
};
pub use status::Status;
