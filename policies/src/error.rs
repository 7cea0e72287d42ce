//! Errors: of one selection (typed, allocation-free unless a plugin builds a
//! message), of a provider validating its parameters, of registration, and of
//! resolving the YAML configuration at startup.

use std::borrow::Cow;
use std::fmt;

use crate::inputs::WorkerInputs;
use crate::table::WorkerWithDpRank;

/// Why one selection produced no worker. The daemon answers the request
/// with it and keeps serving; nothing else changes.
///
/// One pointer wide, so `Result<bool, WorkerSelectionPolicyError>` (what a
/// filter returns once per candidate) comes back in registers; the details
/// are boxed, which allocates only when a selection fails.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSelectionPolicyError(Box<SelectionErrorKind>);

impl WorkerSelectionPolicyError {
    /// A plugin's own failure.
    pub fn failed(message: impl Into<Cow<'static, str>>) -> Self {
        SelectionErrorKind::Failed(message.into()).into()
    }

    pub fn kind(&self) -> &SelectionErrorKind {
        &self.0
    }

    pub fn into_kind(self) -> SelectionErrorKind {
        *self.0
    }
}

impl From<SelectionErrorKind> for WorkerSelectionPolicyError {
    fn from(kind: SelectionErrorKind) -> Self {
        WorkerSelectionPolicyError(Box::new(kind))
    }
}

impl fmt::Display for WorkerSelectionPolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for WorkerSelectionPolicyError {}

/// What went wrong in a selection.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectionErrorKind {
    /// A plugin gave up (its own message).
    #[error("policy failed: {0}")]
    Failed(Cow<'static, str>),
    #[error("no candidate workers")]
    NoCandidates,
    #[error("invalid request context: {0}")]
    InvalidContext(&'static str),
    #[error("the candidate table lacks signal groups the policy declared: {missing}")]
    MissingInputs { missing: WorkerInputs },
    #[error("filter {filter_index} rejected every remaining worker")]
    AllRejected { filter_index: usize },
    #[error("scorer {scorer_index} left the cost of row {row} unwritten or not finite ({value})")]
    InvalidCost {
        scorer_index: usize,
        row: usize,
        value: f64,
    },
    #[error("total cost of row {row} overflowed after scorer {scorer_index} ({value})")]
    NonFiniteTotal {
        scorer_index: usize,
        row: usize,
        value: f64,
    },
    #[error("picker returned row {row} but there are {len} candidates")]
    RowOutOfRange { row: usize, len: usize },
    #[error("pinned worker {worker} is not an eligible candidate")]
    PinnedUnavailable { worker: WorkerWithDpRank },
}

/// A provider refused its parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct WorkerSelectionPolicyProviderError {
    message: String,
}

impl WorkerSelectionPolicyProviderError {
    pub fn new(message: impl Into<String>) -> Self {
        WorkerSelectionPolicyProviderError {
            message: message.into(),
        }
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<serde_yaml::Error> for WorkerSelectionPolicyProviderError {
    fn from(e: serde_yaml::Error) -> Self {
        WorkerSelectionPolicyProviderError::new(e.to_string())
    }
}

/// A registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerSelectionPolicyRegistryError {
    #[error("worker-selection type `{0}` is already registered")]
    DuplicateType(String),
    #[error(
        "`{0}` is not a valid worker-selection type name (use 1-64 characters of a-z, 0-9, `-`, `_`, `.`; `default` is reserved)"
    )]
    InvalidTypeName(String),
}

/// The `worker_selection` configuration cannot be used; startup stops.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyConfigError {
    #[error("worker_selection{}: {message}", at(*line))]
    Yaml {
        line: Option<usize>,
        message: String,
    },
    #[error(
        "worker_selection instance `{instance}`{}: unknown type `{type_name}` (registered: {known})",
        at(*line)
    )]
    UnknownType {
        instance: String,
        type_name: String,
        line: Option<usize>,
        known: String,
    },
    #[error("worker_selection instance `{instance}`{}: the name is already used{}", at(*line), first(*first_line))]
    DuplicateInstance {
        instance: String,
        line: Option<usize>,
        first_line: Option<usize>,
    },
    #[error("worker_selection instance `{instance}`{}: invalid name (use 1-64 characters of a-z, A-Z, 0-9, `-`, `_`, `.`; `default` is reserved)", at(*line))]
    InvalidInstanceName {
        instance: String,
        line: Option<usize>,
    },
    #[error("worker_selection instance `{instance}` (type `{type_name}`){}: invalid parameters: {message}", at(*line))]
    InvalidParameters {
        instance: String,
        type_name: String,
        line: Option<usize>,
        message: String,
    },
    #[error("{scope}{}: selects `{name}`, which is neither `default` nor a configured instance (configured: {configured})", at(*line))]
    UnknownSelection {
        scope: String,
        name: String,
        line: Option<usize>,
        configured: String,
    },
    #[error("request_classifier: {message}")]
    Classifier { message: String },
}

struct At(Option<usize>);
impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(line) => write!(f, " (line {line})"),
            None => Ok(()),
        }
    }
}
fn at(line: Option<usize>) -> At {
    At(line)
}

struct First(Option<usize>);
impl fmt::Display for First {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(line) => write!(f, " by the instance on line {line}"),
            None => Ok(()),
        }
    }
}
fn first(line: Option<usize>) -> First {
    First(line)
}
