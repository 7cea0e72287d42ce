//! kvedge as a gateway's endpoint picker. Gateways built on Envoy (Envoy
//! itself, kgateway, Istio, the Gateway API Inference Extension) ask an
//! "endpoint picker" which pod serves each request over Envoy's
//! external-processing gRPC protocol; this crate answers from kvedge's
//! routing core, so a gateway routes on the same KV-cache view, load and
//! rules as every other kvedge client.
//!
//! - [`body`]: what the pick needs from an OpenAI-compatible body.
//! - [`approx`]: text-chunk hashes for prompts without a tokenizer.
//! - [`tokenize`]: the served models, their tokenizers and chat templates.
//! - [`chat`]: a chat request prepared and rendered as the engine's OpenAI
//!   server renders it; [`template`]: the Jinja environment it renders in.
//! - [`picker`]: one stream's exchange with Envoy, without I/O.
//! - [`prefix`], [`text`]: the per-model cache of tokenized prompts, cut
//!   at a chat's special tokens or at plain text's piece boundaries.
//! - [`ascii`]: the pre-tokenizers' expressions matched by hand on ASCII
//!   text.
//! - [`pool`]: the threads that read large prompts off the serving thread.
//! - [`server`]: the tonic services, and the [`server::Backend`] seam to
//!   the routing core.
//! - [`stage`]: how long reading a prompt and the select take, for the
//!   metrics.
//! - [`http`]: kvedge's own OpenAI-compatible HTTP front door, the
//!   picker with no gateway in front.
//! - `testing` (feature `testing`): a tokenizer trained locally, for
//!   tests and benches.
//! - `fuzzing` (feature `fuzzing`): the body reader's fuzz entry point.

#![forbid(unsafe_code)]

pub mod approx;
pub mod ascii;
pub mod body;
pub mod chat;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod http;
pub mod picker;
pub mod pool;
pub mod prefix;
pub mod server;
pub mod stage;
pub mod template;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod text;
pub mod tokenize;

pub use picker::Limits;
pub use server::{Backend, Picker, Settings, Stats};
pub use tokenize::{ModelSpec, Models};
