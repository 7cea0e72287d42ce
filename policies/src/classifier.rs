//! The request classifier: a stage before scheduling that may admit a
//! request (optionally changing its priority), defer it, or reject it.
//!
//! Seed 000's classifier returns a future; ours is a plain call that returns
//! a verdict, because this crate runs no async runtime and owns no clock: a
//! deferral names how long to wait and the host does the waiting. The
//! sequence-hash snapshot is borrowed for the call, not copied: `None` means
//! the host tracks no hashes for this request, `Some(&[])` an empty prompt.
//! Each hash covers one complete block of `block_size` tokens; a partial last
//! block is not included.

use std::borrow::Cow;

use crate::context::{AgentHeaders, SessionContext};

/// What a classifier sees.
#[derive(Clone, Copy, Debug)]
pub struct ClassifyRequest<'a> {
    pub request_id: &'a str,
    pub prompt_tokens: u32,
    pub block_size: u32,
    pub priority: i32,
    pub sequence_hashes: Option<&'a [u64]>,
    pub session: Option<SessionContext<'a>>,
    pub agent_headers: Option<&'a AgentHeaders>,
    pub now_ms: u64,
}

impl<'a> ClassifyRequest<'a> {
    /// The read-only snapshot of the request's ordered sequence hashes.
    pub fn sequence_hashes(&self) -> Option<&'a [u64]> {
        self.sequence_hashes
    }
}

/// A classifier's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Classification {
    Admit,
    /// Admit with this scheduling priority instead of the request's own.
    AdmitWithPriority(i32),
    /// Ask again after this many milliseconds.
    Defer {
        retry_after_ms: u64,
    },
    /// Refuse; the reason goes back to the caller.
    Reject {
        reason: Cow<'static, str>,
    },
}

/// A pre-scheduling stage. Keep it fast and free of blocking I/O and panics.
pub trait RequestClassifier: Send {
    fn classify(&mut self, request: &ClassifyRequest<'_>) -> Classification;
}

/// Rejects prompts longer than a limit: the deployment-wide bound a
/// deployment enforces before classification.
#[derive(Clone, Copy, Debug)]
pub struct PromptLimitClassifier {
    pub max_prompt_tokens: u32,
}

impl RequestClassifier for PromptLimitClassifier {
    fn classify(&mut self, request: &ClassifyRequest<'_>) -> Classification {
        if request.prompt_tokens > self.max_prompt_tokens {
            Classification::Reject {
                reason: Cow::Borrowed("prompt exceeds the configured token limit"),
            }
        } else {
            Classification::Admit
        }
    }
}
