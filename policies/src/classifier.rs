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
use std::sync::Arc;

use serde::Deserialize;

use crate::context::{AgentHeaders, SessionContext};
use crate::error::{PolicyConfigError, WorkerSelectionPolicyProviderError};
use crate::registry::WorkerSelectionPolicyParameters;

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

/// Makes the daemon's classifier: called at startup and at each reload,
/// so a reload starts with fresh classifier state.
pub type RequestClassifierFactory = Arc<dyn Fn() -> Box<dyn RequestClassifier> + Send + Sync>;

/// A registered classifier type: validates its `parameters` once, at
/// startup, and returns the factory.
pub type RequestClassifierProvider = Arc<
    dyn Fn(
            &WorkerSelectionPolicyParameters,
        ) -> Result<RequestClassifierFactory, WorkerSelectionPolicyProviderError>
        + Send
        + Sync,
>;

/// The classifier type the host ships: [`PromptLimitClassifier`].
pub const PROMPT_LIMIT: &str = "prompt-limit";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLimitParameters {
    max_prompt_tokens: u32,
}

/// The `prompt-limit` provider.
pub(crate) fn prompt_limit_provider(
    parameters: &WorkerSelectionPolicyParameters,
) -> Result<RequestClassifierFactory, WorkerSelectionPolicyProviderError> {
    let p: PromptLimitParameters = parameters.deserialize()?;
    let max_prompt_tokens = p.max_prompt_tokens;
    Ok(Arc::new(move || {
        Box::new(PromptLimitClassifier { max_prompt_tokens })
    }))
}

/// The `request_classifier:` section: one classifier, by registered type.
///
/// ```yaml
/// request_classifier:
///   type: prompt-limit
///   parameters: { max_prompt_tokens: 32768 }
/// ```
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifierConfig {
    #[serde(rename = "type")]
    pub type_name: String,
    #[serde(default)]
    pub parameters: Option<serde_yaml::Value>,
}

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    request_classifier: Option<ClassifierConfig>,
}

impl ClassifierConfig {
    /// The section of a whole configuration file, if it has one (other
    /// top-level keys are the host's).
    pub fn from_yaml_str(source: &str) -> Result<Option<Self>, PolicyConfigError> {
        let doc: Document =
            serde_yaml::from_str(source).map_err(|e| PolicyConfigError::Classifier {
                message: match e.location() {
                    Some(l) => format!("line {}: {e}", l.line()),
                    None => e.to_string(),
                },
            })?;
        Ok(doc.request_classifier)
    }
}

/// A resolved classifier: its type and factory.
#[derive(Clone)]
pub struct ResolvedClassifier {
    pub(crate) type_name: String,
    pub(crate) factory: RequestClassifierFactory,
}

impl std::fmt::Debug for ResolvedClassifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedClassifier")
            .field("type_name", &self.type_name)
            .finish()
    }
}

impl ResolvedClassifier {
    pub fn type_name(&self) -> &str {
        &self.type_name
    }

    /// A fresh classifier.
    pub fn build(&self) -> Box<dyn RequestClassifier> {
        (self.factory)()
    }
}
