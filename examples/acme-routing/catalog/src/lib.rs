//! The catalog a daemon build links: one call that registers every policy
//! type of the organisation's policy crates.

#![forbid(unsafe_code)]

use kvedge_policies::plugins::{RouterPluginRegistry, WorkerSelectionPolicyRegistryError};

pub fn register(
    registry: &mut RouterPluginRegistry,
) -> Result<(), WorkerSelectionPolicyRegistryError> {
    acme_routing_policy::register(registry)
}
