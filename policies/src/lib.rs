//! kvedge's worker-selection pipeline, free of I/O: given a request context
//! and a columnar table of candidate workers, choose one.
//!
//! A policy is filters, then scorers, then a picker (the plugin API,
//! reachable under the same paths as Dynamo's, [`plugins::worker_selection`]
//! and [`plugins::request_classifier`], so a Dynamo policy ports by changing
//! its imports). Policies are built once per routing partition from YAML
//! through the [`registry`] and run under a host contract enforced by
//! [`WorkerSelectionPolicy::select`]. No sockets, threads or clocks: time
//! comes in through the context, randomness from a seeded per-instance RNG,
//! and a warm selection allocates nothing.
//!
//! The default cost formula is documented in [`builtin::default_cost`]; the
//! other shipped types in [`builtin`].

#![forbid(unsafe_code)]

pub mod affinity;
pub mod builtin;
pub mod classifier;
pub mod config;
pub mod context;
pub mod error;
pub mod inputs;
pub mod policy;
pub mod predict;
pub mod registry;
pub mod rng;
pub mod rules;
pub mod table;
pub mod view;
pub mod yaml;

pub use affinity::{AffinityMode, SessionAffinityTable};
pub use config::RouterConfig;
pub use context::{
    AffinityTarget, AgentHeaders, InputTrigger, RoutingPartition, SessionContext,
    WorkerSelectionContext, WorkerType,
};
pub use error::{
    PolicyConfigError, SelectionErrorKind, WorkerSelectionPolicyError,
    WorkerSelectionPolicyProviderError, WorkerSelectionPolicyRegistryError,
};
pub use inputs::WorkerInputs;
pub use policy::{Selection, WorkerFilter, WorkerPicker, WorkerScorer, WorkerSelectionPolicy};
pub use registry::{
    RouterPluginRegistry, RouterPlugins, SelectionOverrides, router_plugin_registry,
};
pub use table::{
    CacheRow, CandidateRow, CandidateTable, LoadRow, OccupancyRow, RECENT_HALF_LIFE_MS,
    WorkerWithDpRank,
};
pub use yaml::WorkerSelectionConfig;

/// The plugin API under Dynamo's module paths.
pub mod plugins {
    pub use crate::error::WorkerSelectionPolicyRegistryError;
    #[allow(deprecated)]
    pub use crate::registry::WorkerSelectionPolicyRegistry;
    pub use crate::registry::{RouterPluginRegistry, RouterPlugins, router_plugin_registry};

    /// Filters, scorers, pickers and what they see.
    pub mod worker_selection {
        pub use crate::config::RouterConfig;
        pub use crate::context::{
            AffinityTarget, AgentHeaders, InputTrigger, RoutingPartition, SessionContext,
            WorkerSelectionContext, WorkerType,
        };
        pub use crate::error::SelectionErrorKind;
        pub use crate::error::{WorkerSelectionPolicyError, WorkerSelectionPolicyProviderError};
        pub use crate::inputs::WorkerInputs;
        pub use crate::policy::{
            Selection, WorkerFilter, WorkerPicker, WorkerScorer, WorkerSelectionPolicy,
        };
        pub use crate::registry::{
            WorkerSelectionPolicyFactory, WorkerSelectionPolicyParameters,
            WorkerSelectionPolicyProvider,
        };
        pub use crate::table::WorkerWithDpRank;
        pub use crate::view::{
            CacheColumns, CacheView, LoadColumns, LoadView, OccupancyColumns, OccupancyView,
            ScoredWorkerCandidate, WorkerCandidate, WorkerCandidates, WorkerInputView,
        };
    }

    /// The pre-scheduling classifier.
    pub mod request_classifier {
        pub use crate::classifier::{
            Classification, ClassifierConfig, ClassifyRequest, PromptLimitClassifier,
            RequestClassifier, RequestClassifierFactory, RequestClassifierProvider,
            ResolvedClassifier,
        };
    }
}
